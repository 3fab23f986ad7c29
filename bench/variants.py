"""The model-variant flags the forward benches share (`bench.forward_rate`,
`bench.capture_invariance`): each turns on one way the capture service may run the base, so
a bench measures the forward as served or one choice apart from it."""

from __future__ import annotations

import argparse

from torch import nn


def add_variant_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--unmasked", action="store_true",
                    help="SDPA without the causal mask a traced forward builds, as the "
                         "compiled capture service runs it")  # fmt: skip
    ap.add_argument("--autotune", action="store_true",
                    help="compile with inductor timing its kernels' configurations (the "
                         "service compiles deterministically, without timing them)")  # fmt: skip
    ap.add_argument("--rope-table", action="store_true",
                    help="the rotary embedding's cos and sin evaluated once a forward, not in "
                         "every layer (STATEBLOCK_CAPTURE_ROPE=table)")  # fmt: skip


def apply_variants(model: nn.Module, args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """The flags' changes to the model, before it compiles; a flag the model cannot take is
    the parser's error (`--autotune` is the compile's: `deterministic=not args.autotune`)."""
    from stateblock.model.capture import use_rope_table, use_unmasked_causal_attention

    if args.unmasked and not use_unmasked_causal_attention(model):
        ap.error("--unmasked: the bench model is not on transformers' SDPA attention")
    if args.rope_table and not use_rope_table(model):
        ap.error("--rope-table: the bench model has no rotary embedding")


def variant_config(args: argparse.Namespace) -> dict[str, bool]:
    """The flags as a report's config records them."""
    return {"unmasked": args.unmasked, "autotune": args.autotune, "rope_table": args.rope_table}
