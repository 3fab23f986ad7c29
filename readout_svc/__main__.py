"""`python -m readout_svc`: readout workers alone, configured by STATEBLOCK_* variables."""

from readout_svc.server import main
from stateblock import runtime

if __name__ == "__main__":
    runtime.run(main())
