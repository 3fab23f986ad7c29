"""Ed25519 signing keys, their ids, and the trust store that readout workers verify against.

A key pair on disk is `<key_id>.key` (PKCS#8 PEM, mode 0600) and `<key_id>.pub`
(SubjectPublicKeyInfo PEM). The key id is derived from the public key, never read from a
file name, so a renamed or copied file cannot make a key claim another key's id.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_ID_CHARS = 16  # 64 bits of SHA-256: ids only need to tell a handful of keys apart
PRIVATE_SUFFIX = ".key"
PUBLIC_SUFFIX = ".pub"


def key_id(public_key: Ed25519PublicKey) -> str:
    """First 16 hex chars of SHA-256 over the raw 32-byte public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_CHARS]


def public_pem(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def load_public_key(pem: bytes) -> Ed25519PublicKey:
    key = serialization.load_pem_public_key(pem)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"not an Ed25519 public key: {type(key).__name__}")
    return key


@dataclass(frozen=True)
class Signer:
    """A private key and its id; what the capture service signs block headers with."""

    private_key: Ed25519PrivateKey
    key_id: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_id", key_id(self.private_key.public_key()))

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    @classmethod
    def generate(cls) -> Signer:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_pem(cls, pem: bytes) -> Signer:
        key = serialization.load_pem_private_key(pem, password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"not an Ed25519 private key: {type(key).__name__}")
        return cls(key)

    @classmethod
    def load(cls, path: Path) -> Signer:
        return cls.from_pem(Path(path).read_bytes())


class TrustStore:
    """Public keys by key id. A block signed by a key not in here is `unknown_key`."""

    def __init__(self, keys: Iterable[Ed25519PublicKey] = ()) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        for key in keys:
            self.add(key)

    def add(self, public_key: Ed25519PublicKey) -> str:
        kid = key_id(public_key)
        self._keys[kid] = public_key
        return kid

    def get(self, kid: str) -> Ed25519PublicKey | None:
        return self._keys.get(kid)

    def __contains__(self, kid: object) -> bool:
        return kid in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._keys))

    @classmethod
    def from_dir(cls, directory: Path) -> TrustStore:
        """Every `*.pub` in directory; private keys beside them are ignored."""
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"trust store directory {directory} does not exist")
        return cls(load_public_key(p.read_bytes()) for p in sorted(directory.glob("*.pub")))


@dataclass(frozen=True)
class KeyPairFiles:
    key_id: str
    private_path: Path
    public_path: Path


def write_keypair(signer: Signer, out_dir: Path) -> KeyPairFiles:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    private_path = out_dir / f"{signer.key_id}{PRIVATE_SUFFIX}"
    public_path = out_dir / f"{signer.key_id}{PUBLIC_SUFFIX}"
    pem = signer.private_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Created 0600 from the start: a chmod after writing leaves a window where it is readable.
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_bytes(public_pem(signer.public_key))
    return KeyPairFiles(signer.key_id, private_path, public_path)


def generate_keypair(out_dir: Path) -> KeyPairFiles:
    """A fresh Ed25519 key pair written to out_dir (`stateblock keys generate --out DIR`)."""
    return write_keypair(Signer.generate(), out_dir)


def load_or_generate_signer(key_dir: Path) -> Signer:
    """The single private key in key_dir, generated on first run (the embedded default)."""
    key_dir = Path(key_dir)
    found = sorted(key_dir.glob(f"*{PRIVATE_SUFFIX}")) if key_dir.is_dir() else []
    if len(found) > 1:
        raise ValueError(f"{key_dir} holds {len(found)} private keys; expected one")
    if found:
        return Signer.load(found[0])
    try:
        return Signer.load(generate_keypair(key_dir).private_path)
    except OSError as e:  # e.g. a read-only Secret mount that holds no key
        raise ValueError(
            f"{key_dir} holds no private key (*{PRIVATE_SUFFIX}) and a new one cannot be "
            f"written there ({e}); mount the signing key or a writable key directory"
        ) from e
