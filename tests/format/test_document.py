"""The one rule every JSON document follows (ckptsdk/format/document.py), checked over all of them."""

from __future__ import annotations

import importlib
import math
import pkgutil
import re

import pytest
from pydantic import ValidationError

import ckptsdk
from ckptsdk.errors import ManifestError
from ckptsdk.format.document import Document, check_format, decode_float, encode_float, parse_document, utc_now

_OPTIONAL = ("ckptsdk.integrations.", "ckptsdk.distributed.")  # need extras / torch.distributed


def _all_documents() -> list[type[Document]]:
    for info in pkgutil.walk_packages(ckptsdk.__path__, "ckptsdk."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:
            if not info.name.startswith(_OPTIONAL):
                raise
    seen: list[type[Document]] = []
    todo = list(Document.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("ckptsdk.") and cls not in seen:
            seen.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(seen, key=lambda c: c.__qualname__)


DOCUMENTS = _all_documents()


def test_every_document_kind_is_found() -> None:
    names = {c.__name__ for c in DOCUMENTS}
    assert {
        "Manifest",
        "LineageRecord",
        "LeaseRecord",
        "AttemptRecord",
        "AuditReport",
        "CacheEntry",
        "DataRecord",
        "TrashTotal",
    } <= names, names


@pytest.mark.parametrize("model", DOCUMENTS, ids=lambda c: c.__name__)
def test_each_document_names_its_format_and_refuses_a_newer_major(model: type[Document]) -> None:
    match = re.fullmatch(r"ckptsdk\.([a-z0-9_.]+)/([0-9]+)(?:\.([0-9]+))?", model.FORMAT)
    assert match, f"{model.__name__}.FORMAT = {model.FORMAT!r} is not ckptsdk.<kind>/<major>.<minor>"
    assert "format" in model.model_fields and model.model_fields["format"].default == model.FORMAT
    newer = f"ckptsdk.{match[1]}/{int(match[2]) + 1}.0"
    with pytest.raises(ValidationError, match="upgrade ckptsdk"):
        model.model_validate({"format": newer})
    with pytest.raises(ManifestError, match="upgrade ckptsdk"):
        parse_document(b'{"format": "%s"}' % newer.encode(), model, key="k")
    assert check_format(model.FORMAT, model.FORMAT) == int(match[3] or 0)


TIME_FIELDS = [
    (m, n) for m in DOCUMENTS for n, f in m.model_fields.items() if f.metadata and "UTC" in (f.description or "")
]


def test_time_fields_are_found() -> None:
    assert {(m.__name__, n) for m, n in TIME_FIELDS} >= {
        ("Manifest", "created_at"),
        ("LineageRecord", "created_at"),
        ("LeaseRecord", "acquired_at"),
        ("LeaseRecord", "renewed_at"),
        ("AttemptRecord", "started_at"),
        ("TrashTotal", "updated_at"),
    }


@pytest.mark.parametrize(("model", "name"), TIME_FIELDS, ids=lambda x: getattr(x, "__name__", x))
def test_each_time_field_refuses_a_local_time(model: type[Document], name: str) -> None:
    with pytest.raises(ValidationError, match="UTC ISO-8601"):
        model.model_validate({"format": model.FORMAT, name: "2026-11-30T06:10:00"})


def test_times_and_floats_have_one_form() -> None:
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", utc_now())
    for x in (0.5, -0.0, math.inf, -math.inf, math.nan):
        back = decode_float(encode_float(x))
        assert (math.isnan(back) and math.isnan(x)) or (back == x and math.copysign(1, back) == math.copysign(1, x))
