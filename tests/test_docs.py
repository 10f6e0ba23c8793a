"""Docs that list what the code declares stay in step with it (cheap, torch-free checks):

- docs/architecture.md's metric table has one row per `MetricSpec` (serve_app/metrics/names.py), with
  its type and labels, and no row for a metric that does not exist;
- docs/openai-api.md names every field the OpenAI request models accept (serving/openai_protocol.py):
  each top-level request field in its bounds table or among the unsupported parameters, each field of
  a nested model (messages, tools, stream options) somewhere in the page;
- docs/operations.md's configuration table has a row for every `ServeConfig` field (serve_app/serving/config.py),
  and none for a key that is not one;
- docs/engine.md's options table has a row for every native engine option (`EngineConfig.from_kwargs`
  names), and docs/vllm-backend.md names every `VLLMOptions` field;
- every link in README.md, docs/ and reports/README.md stays inside the repository and resolves: the
  file exists, and a `#fragment` names a heading of it (GitHub's anchors).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from pydantic import BaseModel

from serve_app.backends.vllm_options import VLLMOptions
from serve_app.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from serve_app.metrics import names
from serve_app.serving import openai_protocol
from serve_app.serving.config import ServeConfig

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
METRIC_TABLE_MARK = "<!-- metric table:"


def _table_rows(text: str, mark: str) -> list[list[str]]:
    """The cells of the Markdown table that follows the line starting with `mark`."""
    lines = text[text.index(mark):].splitlines()[1:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if set("".join(cells)) <= set("-: "):
            continue
        rows.append(cells)
    return rows[1:]  # without the header


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _backticked(text: str) -> set[str]:
    """Every name in backticks, with its dotted / indexed parts: `tools[].function.name` gives tools, function, name."""
    found = set()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks
    for quoted in re.findall(r"`([^`]+)`", text):
        found.update(p for p in re.split(r"[^A-Za-z0-9_]+", quoted) if p)
    return found


def test_metric_table_is_the_metric_specs():
    rows = _table_rows((DOCS / "architecture.md").read_text(), METRIC_TABLE_MARK)
    documented = {}
    for name, kind, labels, meaning in rows:
        assert name not in documented, f"{name} has two rows in docs/architecture.md"
        assert meaning, f"{name}: no meaning in docs/architecture.md"
        documented[name] = (kind, tuple(label.strip() for label in labels.split(",") if label.strip()))
    declared = {m.name: (m.kind, m.labels) for m in names.ALL_METRICS}
    assert sorted(set(declared) - set(documented)) == [], "metrics missing from docs/architecture.md's table"
    assert sorted(set(documented) - set(declared)) == [], "rows of docs/architecture.md's table name no MetricSpec"
    for name, (kind, labels) in declared.items():
        assert documented[name] == (kind, labels), f"{name}: docs/architecture.md says {documented[name]}, names.py {(kind, labels)}"


def _models(model: type[BaseModel], seen: dict[str, type[BaseModel]]) -> None:
    """`model` and every pydantic model its fields can hold."""
    if model.__name__ in seen:
        return
    seen[model.__name__] = model
    pending = [f.annotation for f in model.model_fields.values()]
    while pending:
        tp = pending.pop()
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            _models(tp, seen)
        pending.extend(typing.get_args(tp))


def test_openai_doc_names_every_request_field():
    text = (DOCS / "openai-api.md").read_text()
    top = (openai_protocol.CompletionRequest, openai_protocol.ChatCompletionRequest)
    bounds = _backticked("\n".join(row[0] for row in _table_rows(text, "## Bounds")))
    unsupported = _backticked(_section(text, "## Still unsupported"))
    missing = sorted({f for m in top for f in m.model_fields} - bounds - unsupported)
    assert missing == [], "request fields with no bound in docs/openai-api.md (nor listed as unsupported)"
    nested: dict[str, type[BaseModel]] = {}
    for model in top:
        _models(model, nested)
    anywhere = _backticked(text)
    missing = sorted({f"{m.__name__}.{f}" for m in nested.values() if m not in top for f in m.model_fields
                      if f not in anywhere})
    assert missing == [], "fields of nested request models not named in docs/openai-api.md"


def test_operations_doc_has_every_serve_config_key():
    rows = _table_rows((DOCS / "operations.md").read_text(), "<!-- serve config table:")
    documented = set()
    for row in rows:
        documented |= set(re.findall(r"`([a-z_]+)`", row[0]))
    declared = {f.name for f in dataclasses.fields(ServeConfig) if f.init}  # not the layers built from the keys
    assert sorted(declared - documented) == [], "ServeConfig fields missing from docs/operations.md's table"
    assert sorted(documented - declared) == [], "rows of docs/operations.md's table name no ServeConfig field"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_doc_links_resolve_inside_the_repository():
    pages = [REPO / "README.md", REPO / "reports" / "README.md", *sorted(DOCS.glob("*.md"))]
    problems = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            where = f"{page.relative_to(REPO)} → {target}"
            if re.match(r"[a-z]+:", target):
                problems.append(f"{where}: links outside the repository")
                continue
            file, _, fragment = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                problems.append(f"{where}: no such heading")
    assert problems == [], "\n".join(problems)


def test_engine_options_are_documented():
    rows = _table_rows((DOCS / "engine.md").read_text(), "## Options")
    documented = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row[0])}
    declared = {f.name for c in (ModelConfig, CacheConfig, SchedulerConfig) for f in dataclasses.fields(c)} - {"model"}
    declared |= {"speculative", "core_process"}
    assert sorted(declared - documented) == [], "engine options missing from docs/engine.md's table"
    assert sorted(documented - declared) == [], "rows of docs/engine.md's table name no engine option"
    vllm_doc = _backticked((DOCS / "vllm-backend.md").read_text())
    assert sorted(f.name for f in dataclasses.fields(VLLMOptions) if f.name not in vllm_doc) == []
