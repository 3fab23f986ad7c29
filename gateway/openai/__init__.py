"""The OpenAI-compatible HTTP layer, in vLLM's `entrypoints/openai` shape: one module per
endpoint family (`completions`, `chat`, `tokenize`, `models`), each an APIRouter whose
routes call that family's serving object and an `attach_router(app)`; `serving` holds what
the families share (request screening, the one response and stream renderer), `errors` the
one translation of the gateway's errors to OpenAI error bodies."""
