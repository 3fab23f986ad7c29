"""The public entry point: gRPC stateblock.v1.Gateway and an OpenAI-compatible HTTP API."""
