"""One configuration: what `stateblock up` and each service read, and `stateblock config`.

Every service reads its typed config once from STATEBLOCK_* variables (`<Service>Config.
from_env`, through `stateblock.runtime.Env`, whose errors name the variable). `stateblock
up` takes the same variables as the defaults of its flags, so precedence is the same
everywhere: a flag, then its STATEBLOCK_* variable, then the built-in default.
`effective(environ)` is what `stateblock config` prints: each service's config as it would
start with this environment (or the error naming the variable it cannot use).
The README's configuration table is checked against the names read here
(tests/unit/app/test_settings.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stateblock.runtime import REFERENCE_BASE, REFERENCE_DECODER, ConfigError, Env


@dataclass(frozen=True)
class UpSetting:
    flag: str  # the `stateblock up` option's dest
    variable: str  # STATEBLOCK_<variable>
    read: Callable[[Env, str, Any], Any]
    default: Any


def _str(env: Env, name: str, default: Any) -> Any:
    return env.str(name, default) if default is not None else env.optional_str(name)


def _int(env: Env, name: str, default: int) -> int:
    return env.int(name, default, minimum=0)


def _pos_int(env: Env, name: str, default: int) -> int:
    return env.int(name, default, minimum=1)


# `stateblock up`'s flags and the variables that set their defaults (the services' names)
UP_SETTINGS = (
    UpSetting("data_dir", "DATA_DIR", _str, ".stateblock"),
    UpSetting("host", "GATEWAY_HOST", _str, "127.0.0.1"),
    UpSetting("http_port", "HTTP_PORT", _int, 8000),
    UpSetting("grpc_port", "GRPC_PORT", _int, 50051),
    UpSetting("workers", "WORKERS", _pos_int, 2),
    UpSetting("base", "BASE_DIR", _str, str(REFERENCE_BASE)),
    UpSetting("decoder", "DECODER_DIR", _str, str(REFERENCE_DECODER)),
    UpSetting("engine", "ENGINE", _str, "reference"),
    UpSetting("model_name", "MODEL_NAME", _str, "stateblock-reference"),
    UpSetting("api_key", "API_KEY", _str, None),
    UpSetting("nats_url", "NATS_URL", _str, None),  # unset: start an embedded server
    UpSetting("nats_replicas", "NATS_REPLICAS", _pos_int, 1),
    UpSetting("log_level", "LOG_LEVEL", _str, "warning"),
)


def up_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """The defaults of `stateblock up`'s flags under `environ`; raises ConfigError."""
    env = Env(environ)
    return {s.flag: s.read(env, s.variable, s.default) for s in UP_SETTINGS}


def _service_configs() -> dict[str, Any]:
    from capture_svc.config import CaptureConfig
    from gateway.config import GatewayConfig
    from readout_svc.config import ReadoutServiceConfig

    return {"gateway": GatewayConfig, "capture": CaptureConfig, "readout": ReadoutServiceConfig}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


SECRET_FIELDS = ("api_key",)  # shown as set / unset, never printed


def effective(environ: Mapping[str, str], services: tuple[str, ...] = ()) -> dict[str, Any]:
    """{"up": ..., "gateway": ..., "capture": ..., "readout": ...}: each as it would start
    under `environ`, or {"error": the line naming the variable}."""
    out: dict[str, Any] = {}
    readers: dict[str, Callable[[], Any]] = {"up": lambda: up_defaults(environ)}
    for name, cls in _service_configs().items():
        readers[name] = lambda cls=cls: cls.from_env(environ)
    for name, read in readers.items():
        if services and name not in services:
            continue
        try:
            values = _plain(read())
        except (ConfigError, ValueError) as e:
            out[name] = {"error": str(e)}
            continue
        for secret in SECRET_FIELDS:
            if secret in values:
                values[secret] = "(set)" if values[secret] else None
        out[name] = values
    return out


def variables_read(environ: Mapping[str, str] | None = None) -> set[str]:
    """Every STATEBLOCK_* name `up` and the services look up (for the README check)."""

    class Recording(dict):
        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

    from stateblock.nats_client import NatsOptions
    from stateblock.runtime import event_loop_choice

    seen: set[str] = set()
    env = Recording(environ or {})
    up_defaults(env)
    for cls in _service_configs().values():
        cls.from_env(env)
    NatsOptions.of("nats://127.0.0.1:4222", env)  # every connection's credentials and TLS
    event_loop_choice(env)  # every service's loop
    return {n for n in seen if n.startswith("STATEBLOCK_")}


def dumps(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=False)
