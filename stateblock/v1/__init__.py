"""Generated protobuf and gRPC modules for stateblock.v1 (`python -m stateblock.tools.protogen`)."""
