"""One configuration: what `stateblock up` and each service read, and `stateblock config`.

Every setting is declared once in `stateblock.settings`; each service reads its typed config
from it (`<Service>Config.from_env`, whose errors name the variable). `stateblock up`'s flags
are the settings declared as read by `up` (`UpFlags`), with their variables as defaults, so
precedence is the same everywhere: a flag, then its STATEBLOCK_* variable, then the declared
default. `effective(environ)` is what `stateblock config` prints: each service's config as it
would start with this environment (or the error naming the variable it cannot use).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stateblock import settings
from stateblock.runtime import ConfigError

declared = settings.fields_for(settings.UP)


@dataclass(frozen=True)
class UpFlags:
    """`stateblock up`'s flags (--data-dir, ...) and the settings that set their defaults."""

    data_dir: Path = declared(settings.DATA_DIR)  # NATS store, keys, the capture token, logs
    host: str = declared(settings.GATEWAY_HOST)
    http_port: int = declared(settings.HTTP_PORT)
    grpc_port: int = declared(settings.GRPC_PORT)
    workers: int | None = declared(settings.WORKERS)  # the readout's pull loops; None: by engine
    base: Path = declared(settings.BASE_DIR)
    decoder: Path = declared(settings.DECODER_DIR)
    engine: str = declared(settings.ENGINE)
    model_name: str = declared(settings.MODEL_NAME)
    api_key: str | None = declared(settings.API_KEY, repr=False)
    nats_url: str | None = declared(settings.NATS_URL)  # None: start an embedded server
    nats_replicas: int = declared(settings.NATS_REPLICAS)
    data_plane: str = declared(settings.DATA_PLANE)  # local: rows in a slot pool
    device: str = declared(settings.DEVICE)  # auto: a CUDA device where there is one
    log_level: str = declared(settings.LOG_LEVEL)


def up_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """The defaults of `stateblock up`'s flags under `environ`; raises ConfigError."""
    flags = settings.read_config(UpFlags, environ)
    return {f.name: getattr(flags, f.name) for f in dataclasses.fields(UpFlags)}


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


def dumps(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=False)
