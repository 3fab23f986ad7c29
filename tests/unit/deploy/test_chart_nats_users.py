"""The chart's NATS users: one per component, its password in a Secret only that component's
pods mount, the server's side (bcrypt hashes, the permission table of
`stateblock.app.nats_auth`) in a Secret the bundled NATS includes and no service references.
tests/integration/test_nats_permissions.py runs a real nats-server on the rendered auth.conf."""

from __future__ import annotations

import posixpath
from pathlib import Path

from stateblock.app import nats_auth
from stateblock.nats_client import NatsOptions
from stateblock.protocol import tokens
from tests.unit.deploy.chart import (
    CHART,
    CONFIGS,
    RELEASE,
    env_of,
    of_kind,
    render,
    render_valid,
    secrets_referenced,
    volumes_by_mount,
)
from tests.unit.deploy.test_chart import materialize, nats_user

AUTH = f"{RELEASE}-stateblock-nats-auth"


def test_each_component_gets_its_own_nats_user_and_only_its_own(tmp_path):
    docs = render_valid()
    secrets = of_kind(docs, "Secret")
    passwords = set()
    for component in CONFIGS:
        options = NatsOptions.of("nats://nats:4222", env_of(docs, component))
        assert options.user == component
        mount = volumes_by_mount(docs, component)[str(options.password_file.parent)]
        assert mount["secret"]["secretName"] == nats_user(component) and mount["readOnly"]
        referenced = secrets_referenced(docs, component)
        others = {nats_user(c) for c in CONFIGS if c != component}
        assert nats_user(component) in referenced
        assert not referenced & (others | {AUTH}), component
        # the file the service reads holds a password
        mounted = materialize(secrets[nats_user(component)], tmp_path / component)
        loaded = NatsOptions(
            servers=options.servers,
            user=component,
            password_file=mounted / options.password_file.name,
        ).user_password()
        assert loaded is not None and len(loaded[1]) >= tokens.MIN_CHARS
        passwords.add(loaded[1])
    assert len(passwords) == len(CONFIGS)
    conf = secrets[AUTH]["stringData"]["auth.conf"]
    for component in CONFIGS:
        assert conf.count(f'user: "{component}"') == 1
    assert conf.count('password: "$2a$') == len(CONFIGS)  # bcrypt hashes only
    assert not any(p in conf for p in passwords)


def test_without_nats_users_the_services_connect_without_credentials():
    docs = render_valid({"natsAuth": {"enabled": False}})
    assert not any("-nats-" in name for name in of_kind(docs, "Secret"))
    for component in CONFIGS:
        options = NatsOptions.of("nats://nats:4222", env_of(docs, component))
        assert options.user is None and options.password_file is None


def test_the_charts_permission_table_is_the_stacks():
    table = CHART / "files" / "nats-permissions.json"
    assert table.read_text() == nats_auth.table_json(), (
        "regenerate it: python -c 'from stateblock.app import nats_auth; "
        'print(nats_auth.table_json(), end="")\' > deploy/helm/stateblock/files/'
        "nats-permissions.json"
    )


def test_the_bundled_nats_includes_the_users_secret(chart_with_nats_stub: Path):
    """What the NATS chart does with our values, in its own context: the pod mounts the
    Secret the parent renders, and the config's include names its auth.conf."""
    (chart_with_nats_stub / "charts/nats/templates/wiring.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-wiring\n"
        "data:\n"
        '  include: {{ index .Values.config.merge "00$include" | quote }}\n'
        "  secret: {{ tpl (index (index .Values.podTemplate.patch 0).value.secret.secretName"
        ' "$tplYaml") . | quote }}\n'
        "  mount: {{ (index .Values.container.patch 0).value.mountPath | quote }}\n"
    )
    docs = render({"nats": {"enabled": True}}, chart_with_nats_stub)
    wiring = of_kind(docs, "ConfigMap")[f"{RELEASE}-wiring"]["data"]
    assert wiring["secret"] == AUTH and AUTH in of_kind(docs, "Secret")
    # the NATS chart mounts its config at /etc/nats-config; includes are relative to it
    included = posixpath.normpath(posixpath.join("/etc/nats-config", wiring["include"]))
    assert included == f"{wiring['mount']}/auth.conf"
    assert "auth.conf" in of_kind(docs, "Secret")[AUTH]["stringData"]
