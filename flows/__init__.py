"""Prefect flows (the control plane) and the `flexmarl` command line, the outermost layer."""
