"""`python -m capture_svc`: the capture service alone, configured by STATEBLOCK_* variables."""

from capture_svc.server import main
from stateblock import runtime

if __name__ == "__main__":
    try:
        runtime.run(main())
    except runtime.ConfigError as e:  # one line, not a traceback: the setting to fix
        raise SystemExit(f"capture_svc: {e}") from None
