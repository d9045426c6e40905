"""The user-visible API pinned: every client method's signature and docstring (async and blocking), and every HTTP
route with its method, retry class, answer encoding and request-body schema. A change to any of them is a change of
the public API or the wire format: it must be deliberate, so it shows up here as a diff against ``pins/api.json``.

Regenerate the pin after a deliberate change with ``python tests/test_api_pins.py`` (and say so in CHANGELOG.md).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from arctic_rl.client import ArcticRLClient, SyncArcticRLClient
from arctic_rl.http_api import API_PREFIX, OPERATIONS

PIN = Path(__file__).resolve().parent / "pins" / "api.json"


def _client_surface(client_class: type) -> dict[str, Any]:
    surface: dict[str, Any] = {}
    for name, member in sorted(vars(client_class).items()):
        if name.startswith("_") and name not in ("__enter__", "__exit__", "__aenter__", "__aexit__"):
            continue
        if not callable(member):
            continue
        surface[name] = {
            "signature": str(inspect.signature(member)),
            "async": inspect.iscoroutinefunction(member),
            "doc": inspect.getdoc(member),
        }
    return surface


def _http_surface() -> dict[str, Any]:
    return {
        f"{API_PREFIX}/{op}": {
            "method": operation.method,
            "idempotent": operation.idempotent,
            "tensors_out": operation.tensors_out,
            "body": operation.body.model_json_schema(),
        }
        for op, operation in sorted(OPERATIONS.items())
    }


def current_surface() -> dict[str, Any]:
    return {
        "ArcticRLClient": _client_surface(ArcticRLClient),
        "SyncArcticRLClient": _client_surface(SyncArcticRLClient),
        "http": _http_surface(),
    }


def test_client_methods_and_http_routes_match_the_pin() -> None:
    pinned = json.loads(PIN.read_text())
    current = json.loads(json.dumps(current_surface()))
    for section in ("ArcticRLClient", "SyncArcticRLClient", "http"):
        assert sorted(current[section]) == sorted(pinned[section]), section
        for name in pinned[section]:
            assert current[section][name] == pinned[section][name], f"{section}.{name}"


def test_both_clients_offer_the_same_operations_with_the_same_signatures() -> None:
    surface = current_surface()
    async_methods, blocking_methods = surface["ArcticRLClient"], surface["SyncArcticRLClient"]
    operations = set(OPERATIONS)
    for methods in (async_methods, blocking_methods):
        assert operations <= set(methods)
    for op in operations:
        assert async_methods[op]["signature"] == blocking_methods[op]["signature"], op
        assert async_methods[op]["async"] and not blocking_methods[op]["async"], op


if __name__ == "__main__":
    PIN.write_text(json.dumps(current_surface(), indent=1, sort_keys=True) + "\n")
