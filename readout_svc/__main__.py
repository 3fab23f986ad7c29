"""`python -m readout_svc`: readout workers alone, configured by STATEBLOCK_* variables."""

import asyncio

from readout_svc.server import main

if __name__ == "__main__":
    asyncio.run(main())
