"""`python -m capture_svc`: the capture service alone, configured by STATEBLOCK_* variables."""

import asyncio

from capture_svc.server import main

if __name__ == "__main__":
    asyncio.run(main())
