"""`stateblock`: the one command-line entry point."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

from stateblock.app import cli_audit, cli_models, settings
from stateblock.app.cli_models import DEFAULTS, REFERENCE, command
from stateblock.runtime import REPO
from stateblock.settings import API_KEY, ASK, UP, markdown_table, shown_default

BENCHES = {  # each runs as its own module from the checkout (`python -m bench.NAME`)
    "api-fidelity": "bench.api_fidelity",
    "cpu-latency": "bench.latency_cpu",
    "engines-cpu": "bench.engines_cpu",
    "throughput-cpu": "bench.throughput_cpu",
    "e2e": "bench.e2e_gpu",
    "load": "bench.load_gpu",
    "smoke": "bench.gpu_smoke",
}


def cmd_config(a: argparse.Namespace) -> int:
    """Each service's config as it would start with this environment; exit 2 when one of
    them cannot start (its entry names the variable). --markdown: the README's table."""
    if a.markdown:
        print(markdown_table(), end="")
        return 0
    config = settings.effective(os.environ, tuple(a.service or ()))
    print(settings.dumps(config))
    return 2 if any("error" in v for v in config.values()) else 0


def cmd_up(a: argparse.Namespace) -> int:

    from stateblock import runtime
    from stateblock.app import stack as embedded

    try:  # a flag wins; an unusable variable is one line naming it, before anything starts
        defaults = settings.up_defaults(os.environ)
    except runtime.ConfigError as e:
        print(f"stateblock up: {e}", file=sys.stderr)
        return 2
    for name, value in defaults.items():
        if not hasattr(a, name):
            setattr(a, name, value)

    runtime.configure_logging(a.log_level)
    try:  # the console shows the URLs, not a weight-loading progress bar
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    # the settings no flag covers reach the services from the environment, as they would
    # reach each service's own process
    environment = embedded.environment_settings(os.environ)
    config = embedded.UpConfig(**up_config_values(a), service_settings=environment)
    try:  # a variable no service could start with: the same one line, nothing started
        config.check()
    except (runtime.ConfigError, ValueError) as e:
        print(f"stateblock up: {e}", file=sys.stderr)
        return 2

    def ready(urls: embedded.StackUrls) -> None:
        print(f"stateblock is up (model {config.model_name}, signing key {urls.key_id})")
        print(f"  OpenAI HTTP API  {urls.http}/v1")
        print(f"  gRPC Gateway     {urls.grpc}")
        print(f"  metrics          {urls.http}/metrics")
        print(f"  NATS             {urls.nats}")
        if not a.ask:
            print(
                f'try: stateblock ask "copy: hello" --url {urls.http}   (Ctrl-C stops)', flush=True
            )
            return

        def ask_then_stop() -> None:
            # --ask: one real request through the HTTP API, then the same clean stop as Ctrl-C,
            # whatever happened to the ask: a reader that went away (`| head -1`) leaves a
            # BrokenPipeError here, and without the stop the stack would run on, unattended
            try:
                print(f"ask: {a.ask}", flush=True)
                results.append(
                    ask(urls.http, a.ask, timeout=120.0, verbose=True, api_key=a.api_key)
                )
            except Exception:  # noqa: BLE001 - the exit status says the ask failed
                results.append(1)
            finally:
                os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=ask_then_stop, daemon=True).start()

    results: list[int] = []

    try:
        runtime.run(embedded.up(config, ready))
    except Exception as e:  # start-up failures: one clear line, not a traceback
        print(f"stateblock up: {e}", file=sys.stderr)
        return 1
    print("stateblock stopped", flush=True)
    return results[0] if results else 0


# UpFlags' names that UpConfig spells otherwise; log_level is configured, not passed on
_UP_CONFIG_NAMES = {"base": "base_dir", "decoder": "decoder_dir", "log_level": None}


def up_config_values(a: argparse.Namespace) -> dict:
    """UpConfig's keyword arguments from `up`'s flags (each a declared setting's value)."""
    values = {}
    for f in dataclasses.fields(settings.UpFlags):
        name = _UP_CONFIG_NAMES.get(f.name, f.name)
        if name is not None:
            value = getattr(a, f.name)
            values[name] = Path(value) if f.type in (Path, "Path") else value
    return values


def cmd_ask(a: argparse.Namespace) -> int:
    return ask(
        a.url,
        a.prompt,
        model=a.model,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        timeout=a.timeout,
        verbose=a.verbose,
        api_key=a.api_key,
    )


def ask(
    url: str,
    prompt: str,
    *,
    model: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    timeout: float = 120.0,
    verbose: bool = False,
    api_key: str | None = None,
) -> int:
    """One chat completion from a running gateway, printed; the exit status."""
    import urllib.error
    import urllib.request

    base = url.rstrip("/")

    def call(path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        req = urllib.request.Request(base + path, data=data, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    try:
        model = model or call("/v1/models")["data"][0]["id"]
        body: dict = {"model": model, "messages": [{"role": "user", "content": prompt}]}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if temperature is not None:
            body["temperature"] = temperature
        reply = call("/v1/chat/completions", body)
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = str(e)
        print(f"error {e.code}: {message}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"cannot reach a gateway at {base}: {e}", file=sys.stderr)
        return 1
    print(reply["choices"][0]["message"]["content"])
    if verbose:
        print(json.dumps({"finish_reason": reply["choices"][0]["finish_reason"], **reply["usage"]}))
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    from stateblock.engines.onnx_graph import OnnxGraphError, default_graph_path, export_checkpoint
    from stateblock.model.checkpoint import DecoderError

    out = Path(a.out) if a.out else default_graph_path(a.decoder)
    try:
        manifest = export_checkpoint(a.decoder, a.base, out)
        if a.tensorrt:
            from stateblock.tools.tensorrt_build import build_engine

            build_engine(out, Path(a.tensorrt))
    except (OnnxGraphError, DecoderError, OSError, RuntimeError, ValueError) as e:
        print(f"stateblock export: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"onnx": str(out), "manifest": str(out) + ".json",
                      "opset": manifest["opset"], "sha256": manifest["onnx_sha256"]}))  # fmt: skip
    return 0


def cmd_keys_generate(a: argparse.Namespace) -> int:
    from stateblock.protocol.keys import generate_keypair

    files = generate_keypair(Path(a.out))
    print(json.dumps({"key_id": files.key_id, "private": str(files.private_path),
                      "public": str(files.public_path)}))  # fmt: skip
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    import subprocess

    # bench/ is a folder of this checkout, not part of the installed product: each bench
    # runs as its own module from the checkout, in a process of its own
    module = BENCHES[a.bench]
    if not (REPO / (module.replace(".", "/") + ".py")).is_file():
        print(f"stateblock bench: {module} is not in this checkout", file=sys.stderr)
        return 1
    return subprocess.call([sys.executable, "-m", module, *a.args], cwd=REPO)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stateblock", description=__doc__, formatter_class=DEFAULTS)
    sub = p.add_subparsers(
        dest="cmd", required=True, help="the command (stateblock COMMAND -h for its flags)"
    )

    cli_models.add_parsers(sub)

    _add_up(sub)
    _add_config(sub)
    _add_ask(sub)
    _add_export(sub)
    cli_audit.add_parser(sub)
    _add_bench(sub)
    _add_keys(sub)
    return p


def _add_up(sub) -> None:
    """`stateblock up`: each setting a flag, then its variable, then its default."""
    u = command(sub, "up", cmd_up, "run the embedded default: nats-server and every service")
    # each flag: the flag, else its STATEBLOCK_* variable, else the declared default
    for f in dataclasses.fields(settings.UpFlags):
        setting = f.metadata["setting"]
        shown = shown_default(setting, UP).replace("`", "")
        u.add_argument(
            "--" + f.name.replace("_", "-"),
            type=setting.type if setting.type in (int, float) else str,
            default=argparse.SUPPRESS,
            help=f"{setting.help} (default: ${setting.name}, else {shown})".replace("`", ""),
        )
    u.add_argument("--ask", default=None, help="ask this once through the HTTP API, then stop")


def _add_config(sub) -> None:
    """`stateblock config`: the effective settings, as JSON or the README table."""
    c = command(
        sub,
        "config",
        cmd_config,
        "print the effective configuration of `up` and each service (JSON)",
    )
    c.add_argument(
        "--service",
        choices=("up", "gateway", "capture", "readout"),
        action="append",
        help="only these (repeatable; default: all)",
    )
    c.add_argument(
        "--markdown",
        action="store_true",
        help="print every setting as the README's configuration table instead",
    )


def _add_ask(sub) -> None:
    """`stateblock ask`: one chat completion from a running gateway."""
    q = command(sub, "ask", cmd_ask, "ask a running gateway (chat completion)")
    q.add_argument("prompt", help="the user message")
    q.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's HTTP URL")
    q.add_argument("--model", default=None, help="default: the gateway's first model")
    q.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="answer tokens (default: the decoder's trained depth)",
    )
    q.add_argument("--temperature", type=float, default=None, help="0 for greedy (the default)")
    q.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the answer")
    q.add_argument("-v", "--verbose", action="store_true", help="print finish reason and usage")
    q.add_argument(
        "--api-key",
        default=API_KEY.read(os.environ, ASK),
        help="sent as Authorization: Bearer (default: $STATEBLOCK_API_KEY)",
    )


def _add_export(sub) -> None:
    """`stateblock export`: the readout decoder to ONNX (and TensorRT)."""
    x = command(sub, "export", cmd_export, "export the readout decoder to ONNX (opset 17)")
    x.add_argument("--out", default=None, help="FILE.onnx (default: DECODER/readout.onnx)")
    x.add_argument("--decoder", default=str(REFERENCE / "decoder"), help="decoder directory")
    x.add_argument(
        "--base",
        default=str(REFERENCE / "base"),
        help="base model directory (its lm_head is checked)",
    )
    x.add_argument("--tensorrt", default=None, help="also build a TensorRT engine here")


def _add_bench(sub) -> None:
    """`stateblock bench`: a benchmark module of this checkout."""
    bn = command(sub, "bench", cmd_bench, "benchmarks (docs/BENCHMARKS.md); BENCH --help for each")
    bn.add_argument("bench", choices=sorted(BENCHES), help="which benchmark")
    bn.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")


def _add_keys(sub) -> None:
    """`stateblock keys generate`: a new signing key pair."""
    k = sub.add_parser("keys", formatter_class=DEFAULTS, help="signing keys")
    ksub = k.add_subparsers(dest="keys_cmd", required=True, help="generate: a new key pair")
    kg = command(ksub, "generate", cmd_keys_generate, "a new Ed25519 key pair and its key id")
    kg.add_argument("--out", required=True, help="directory for <key_id>.key and <key_id>.pub")


# modules of the optional extras (pyproject.toml): a command that needs one says which
EXTRA_OF = {"tqdm": "train", "matplotlib": "train", "onnx": "export", "tensorrt": "tensorrt"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.fn(args)
    except ModuleNotFoundError as e:
        extra = EXTRA_OF.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"stateblock {args.cmd}: needs the {extra!r} extra: pip install 'stateblock[{extra}]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
