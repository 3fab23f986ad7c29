"""`python -m gateway`: the gateway alone, configured by STATEBLOCK_* variables."""

from gateway.server import main
from stateblock import runtime

if __name__ == "__main__":
    runtime.run(main())
