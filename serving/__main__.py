"""`python -m serving`: the same flags as `kvmem serve`."""

from serving.ops.cli import run_module

if __name__ == "__main__":
    run_module()
