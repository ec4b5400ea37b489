"""Which run-root URIs the storage layer can open, decided without importing fsspec."""

from __future__ import annotations

import re

S3_PROTOCOLS = frozenset({"s3", "s3a"})
LOCAL_PROTOCOLS = frozenset({"file", "local"})
ROOT_PROTOCOLS = S3_PROTOCOLS | LOCAL_PROTOCOLS
"""Protocols with an atomic put-if-absent in :mod:`asyncrl.storage.fs`."""

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def root_protocol(uri: str) -> str:
    """The protocol of ``uri``: its ``scheme://`` lower-cased, ``file`` for a plain path."""
    match = _SCHEME.match(uri)
    return match.group(1).lower() if match else "file"


def check_root_protocol(uri: str) -> str:
    """``uri``'s protocol, or ``ValueError`` naming it when the storage layer cannot hold a
    run root there (only local paths, ``file://`` and ``s3://`` have atomic writes)."""
    protocol = root_protocol(uri)
    if protocol not in ROOT_PROTOCOLS:
        raise ValueError(
            f"scheme {protocol}:// is not supported for a run root ({uri!r}): use a local path, "
            "file:// or s3:// (any S3-compatible store: endpoint_url in storage.options)"
        )
    return protocol
