from pathlib import Path

from flexmarl.config_docs import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_reference_is_up_to_date() -> None:
    assert DOC.read_text() == render(), "run: python -m flexmarl.config_docs > docs/configuration.md"
