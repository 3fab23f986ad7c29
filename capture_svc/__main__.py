"""`python -m capture_svc`: the capture service alone, configured by STATEBLOCK_* variables."""

from capture_svc.server import main
from stateblock import runtime

if __name__ == "__main__":
    runtime.run(main())
