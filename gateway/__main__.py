"""`python -m gateway`: the gateway alone, configured by STATEBLOCK_* variables."""

import asyncio

from gateway.server import main

if __name__ == "__main__":
    asyncio.run(main())
