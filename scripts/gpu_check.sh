#!/usr/bin/env bash
# The GPU check of issue 16 (flexmarl/bench/gpu_check.py) on a lent machine with nothing but torch there.
#   scripts/gpu_check.sh stage   here: the wheels the machine lacks into .whl/, SmolLM2's config and tokenizer
#                                into .gpu/ (both ignored by git; carry both, 64.4 MB together)
#   scripts/gpu_check.sh run [ARGS]  there: install the wheels into /tmp/site, then the check, into $OUT (ARGS go
#                                to flexmarl.bench.gpu_check, e.g. --sections pipeline --pipeline-repeats 1)
set -euo pipefail
cd "$(dirname "$0")/.."

# The machine has torch, transformers, accelerate, peft, pyarrow, numpy, matplotlib and typer; these are the
# rest of what the pipeline imports (the lock's versions), built for its Python 3.12.
WHEELS=(dask==2026.8.0 distributed==2026.8.0 deltalake==1.6.6 arro3-core==0.9.1 deprecated pydantic==2.14.4
        pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions tenacity==9.2.1
        tornado==6.6.1 tblib==3.2.2 zict==3.0.0 partd==1.4.2 locket==1.0.0)

case "${1:-}" in
stage)
  rm -rf .whl .gpu && mkdir -p .whl .gpu/tokenizer
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
  src=$(.venv/bin/python -c 'from flexmarl.models.loading import resolve_model; print(resolve_model("smollm2-135m-instruct"))')
  cp "$src"/{config.json,tokenizer_config.json,chat_template.jinja} .gpu/tokenizer/
  gzip -c "$src/tokenizer.json" > .gpu/tokenizer/tokenizer.json.gz  # 3.5 MB -> 0.9 MB: the carry limit is 64 MiB
  du -sh .whl .gpu
  ;;
run)
  out=${OUT:-gpu_check_out}
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
  gunzip -kf .gpu/tokenizer/tokenizer.json.gz
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
  # inside the device call's own limit, so that the JSON written so far (after each section) comes back
  timeout "${GPU_CHECK_TIMEOUT_S:-480}" python3 -m flexmarl.bench.gpu_check "$out" --tokenizer-dir .gpu/tokenizer \
    --work-dir /tmp/gpu_check_work "${@:2}" 2>&1 | tee "$out/gpu_check.log"
  ;;
*)
  echo "usage: scripts/gpu_check.sh stage|run" >&2; exit 2
  ;;
esac
