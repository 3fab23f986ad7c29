"""The chart tests' shared fixtures: the default render, a key pair, and the chart with a
stand-in for its NATS dependency, for the tests that enable it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stateblock.protocol.keys import generate_keypair
from tests.unit.deploy.chart import CHART, render_valid


@pytest.fixture
def chart_with_nats_stub(tmp_path) -> Path:
    """The chart with a stand-in for the NATS dependency in charts/ (the real one is not
    fetched here), named and configured as the official chart is."""
    chart = tmp_path / "stateblock"
    shutil.copytree(CHART, chart)
    stub = chart / "charts" / "nats"
    (stub / "templates").mkdir(parents=True)
    (stub / "Chart.yaml").write_text("apiVersion: v2\nname: nats\nversion: 1.3.0\n")
    (stub / "templates" / "service.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {{ .Release.Name }}-nats\n"
        "spec:\n  ports:\n    - name: nats\n      port: 4222\n"
    )
    (stub / "templates" / "config.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-nats-config\n"
        "data:\n  jetstream: {{ .Values.config.jetstream.enabled | quote }}\n"
    )
    return chart


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render_valid()


@pytest.fixture(scope="module")
def keypair(tmp_path_factory) -> tuple[str, str, str]:
    files = generate_keypair(tmp_path_factory.mktemp("keys"))
    return files.key_id, files.private_path.read_text(), files.public_path.read_text()
