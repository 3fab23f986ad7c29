"""`stateblock audit`: the engine parity audit and release gate, or the determinism gate."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from stateblock.app.cli_models import REFERENCE, command, device_of


class AuditRefused(Exception):
    """The audit cannot run as asked; its message is the one line the command prints."""

    def __init__(self, message: str, status: int) -> None:
        self.status = status
        super().__init__(message)


def cmd_audit(a: argparse.Namespace) -> int:
    from stateblock.tools import audit

    device = device_of(a.device)
    try:
        engine_name, options = _engine_of(a)
        if a.determinism:
            report = _determinism_report(a, engine_name, device)
        else:
            report = _parity_report(a, engine_name, device, options)
    except AuditRefused as e:
        print(f"stateblock audit: {e}", file=sys.stderr)
        return e.status
    if a.json:
        audit.write_json(report, a.json)
    print(json.dumps(report, indent=2))
    return 0 if report["gate"] == "PASS" else 1


def _engine_of(a: argparse.Namespace) -> tuple[str, dict]:
    """The audited engine's name and options, checked before anything is loaded."""
    from stateblock.engines import UnknownEngine, require_engine

    engine_name = a.engine or ("reference" if a.determinism else None)
    if engine_name is None:
        raise AuditRefused("--engine NAME is required (or --determinism)", 2)
    try:
        require_engine(engine_name)  # fail closed before anything is loaded
    except UnknownEngine as e:
        raise AuditRefused(str(e), 2) from None
    # the serving setting the readout service reads from STATEBLOCK_GREEDY_DTYPE: the GPU's
    # bf16 fast path can then be audited where it serves, or its numerics on the CPU
    options = {"greedy_dtype": a.greedy_dtype} if a.greedy_dtype else {}
    if options and (engine_name != "torch" or a.determinism):
        raise AuditRefused("--greedy-dtype applies to the torch engine's parity audit only", 2)
    return engine_name, options


def _determinism_report(a: argparse.Namespace, engine_name: str, device: str) -> dict:
    """The determinism gate: a real stack over NATS, our own or the one at --nats-url (the
    parity audit needs no bus)."""
    import asyncio
    import tempfile

    from stateblock import runtime
    from stateblock.app import determinism as audit_determinism
    from stateblock.train import tasks

    runtime.configure_logging("warning")  # the stack's logs would bury the report
    n = a.n_prompts or 8
    prompts = [e.prompt for e in tasks.generate(n, split="heldout", seed=a.seed)]
    if a.nats_url is None:  # our own stack and nats-server, in a throwaway dir
        with tempfile.TemporaryDirectory(prefix="stateblock-audit-") as tmp:
            return asyncio.run(audit_determinism.embedded_determinism(
                data_dir=Path(a.data_dir or tmp), base_dir=Path(a.base),
                decoder_dir=Path(a.decoder), engine_name=engine_name, prompts=prompts,
                depth=a.depth, resubmit=not a.no_resubmit, device=device,
            ))  # fmt: skip
    return asyncio.run(audit_determinism.external_determinism(
        a.nats_url, base_dir=Path(a.base), decoder_dir=Path(a.decoder),
        engine_name=engine_name, trusted_keys=Path(a.trusted_keys),
        grpc_target=a.grpc, prompts=prompts if a.grpc else [], depth=a.depth,
        resubmit=not a.no_resubmit, listen_s=a.listen_s, device=device,
    ))  # fmt: skip


def _parity_report(a: argparse.Namespace, engine_name: str, device: str, options: dict) -> dict:
    """The parity audit of `engine_name` against the reference engine, with its plot and
    markdown table when asked for."""
    from stateblock import runtime
    from stateblock.engines import create_engine
    from stateblock.model.loading import load_serving_model
    from stateblock.runtime import DEFAULT_MODEL_NAME
    from stateblock.tools import audit

    runtime.configure_logging("warning")  # stdout carries the JSON report alone
    if a.export and engine_name == "onnx":  # asked for: the engine itself never exports
        from stateblock.engines.onnx_graph import default_graph_path, export_checkpoint

        graph = default_graph_path(a.decoder)
        export_checkpoint(a.decoder, a.base, graph)
        print(f"stateblock audit: exported {graph}", file=sys.stderr)
    model = load_serving_model(DEFAULT_MODEL_NAME, a.base, a.decoder, device=device)
    try:
        engine = create_engine(engine_name, model, device, **options)
    except Exception as e:  # a missing export or runtime: one clear line, not a traceback
        raise AuditRefused(f"engine {engine_name!r} did not load: {e}", 1) from None
    report = audit.parity_audit(
        model,
        engine,
        create_engine("reference", model, device),
        depths=[int(d) for d in a.depths.split(",")],
        n_prompts=a.n_prompts or 32,
        seed=a.seed,
        lanes=a.lanes,
    )
    report["settings"]["engine_options"] = options
    if a.plot:
        audit.plot(report, a.plot)
    if a.markdown:
        Path(a.markdown).write_text(audit.markdown(report, "stateblock " + shlex.join(a.argv)))
    return report


def add_parser(sub) -> None:
    """`stateblock audit`: the parity audit and release gate, or the determinism gate."""
    au = command(sub, "audit", cmd_audit, "engine parity audit and release gate; --determinism")
    au.add_argument("--engine", default=None, help="engine audited against reference")
    au.add_argument("--determinism", action="store_true", help="the determinism gate instead")
    au.add_argument("--export", action="store_true", help="onnx: run `stateblock export` first")
    au.add_argument("--base", default=str(REFERENCE / "base"), help="base model directory")
    au.add_argument("--decoder", default=str(REFERENCE / "decoder"), help="decoder directory")
    au.add_argument("--device", default="auto", help="cuda, cpu, or auto")
    au.add_argument("--depths", default="256,512,1024,2048,4096,8192", help="parity depths")
    au.add_argument("--n-prompts", type=int, default=None, help="held-out prompts (32; 8)")
    au.add_argument("--seed", type=int, default=4321, help="seed of the audited prompts")
    au.add_argument("--lanes", type=int, default=8, help="lanes per packed enqueue")
    au.add_argument(
        "--greedy-dtype", choices=["bfloat16", "float32"], default=None,
        help="torch: plain greedy cohorts in this dtype (default: bf16 on a GPU, exact on a CPU)",
    )  # fmt: skip
    au.add_argument("--json", help="write the JSON report here")
    au.add_argument("--plot", help="write the PNG plot here (parity)")
    au.add_argument("--markdown", help="write the markdown table here (parity)")
    au.add_argument("--nats-url", default=None, help="determinism: audit this NATS, not embedded")
    au.add_argument("--grpc", default=None, help="determinism: gateway gRPC to send prompts to")
    au.add_argument("--trusted-keys", default="keys", help="determinism with --nats-url")
    au.add_argument("--listen-s", type=float, default=0.0, help="determinism: tap other traffic")
    au.add_argument("--depth", type=int, default=256, help="determinism: max_tokens per prompt")
    au.add_argument("--no-resubmit", action="store_true", help="determinism: re-read only")
    au.add_argument("--data-dir", default=None, help="determinism, embedded: NATS store, keys")
