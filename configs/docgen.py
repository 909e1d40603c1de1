"""Writes docs/configuration.md from the schema, so the reference cannot drift from the code.

    python -m configs.docgen > docs/configuration.md

Everything comes from configs/schema.py: the sections (PdserveConfig's fields, in order), each field's
type, default, choices and minimum (its metadata), and its comment, read from the source (the lines of
comment right above the field plus the one at its end). tests/test_config_docs.py fails when the
committed page differs from this output. Stdlib only, like the schema.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize

from configs import environment, schema

COMMAND = "python -m configs.docgen > docs/configuration.md"

HEADER = f"""# Configuration

<!-- GENERATED from configs/schema.py by `{COMMAND}`; edit the schema, not this page. -->

Every setting of every pdserve process is one field of the typed schema in
[`configs/schema.py`](../configs/schema.py). The same schema serves every role (gateway, prefill,
decode, `pdserve serve`, `pdserve generate`); a process reads the fields it uses.

## Where a value comes from

Later wins ([`configs/loader.py`](../configs/loader.py)):

1. the defaults below;
2. a YAML file, `--config FILE`: `{{section: {{field: value}}}}`
   ([`configs/local.yaml`](../configs/local.yaml) is a commented one-machine preset);
3. the environment: `{environment.ENV_PREFIX}<SECTION>_<FIELD>`, e.g. `{environment.ENV_PREFIX}ENGINE_BLOCK_SIZE=32`;
4. the command line: `--set section.field=value` (repeatable) on `pdserve gateway|prefill|decode`,
   and the named flags of `pdserve serve` (`--model`, `--port`, `--prefill`, `--decode`, `--api-key`, ...;
   `pdserve serve --help` lists them), which it passes to the processes it starts as `{environment.ENV_PREFIX}*`
   variables written over inherited ones.

A YAML key or `--set` that is not in the schema is refused at start-up with the key named (and, where
one is close, the real one suggested). An `{environment.ENV_PREFIX}*` variable that names no field (a Kubernetes
service link such as `{environment.ENV_PREFIX}GATEWAY_PORT=tcp://...`, a typo) is ignored with one warning
naming it (configs/environment.py); `{environment.API_KEY_ENV}` adds one accepted key to `gateway.api_keys`.
Values from the environment and the command line are text, read as the field's
type: booleans as `true/false`, `1/0`, `yes/no`, `on/off`; lists comma-separated
(`{environment.ENV_PREFIX}GATEWAY_API_KEYS=k1,k2`); `none`, `null` or nothing for a field that may be None.
Choices and minimums are checked once, after all layers are merged. Each failure is a `ConfigError`
naming the dotted key and the value (see [troubleshooting](troubleshooting.md)).

These variables are read by the code they concern, not by the schema, and are never refused:
{", ".join(f"`{name}`" for name in sorted(environment.PROCESS_ENV))} (see [the engine](engine.md)).
"""


def field_comments(cls: type) -> dict[str, str]:
    """field name -> its comment: the comment lines right above it, then the one on its own lines. A field
    with neither, right below another field, shares that field's comment block (one block above a group)."""
    source = inspect.getsource(cls)
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    lines = source.splitlines()
    result, previous_end, previous_above = {}, -1, []
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        own = [comments[r] for r in range(node.lineno, node.end_lineno + 1) if r in comments]
        if not above and not own and previous_end == node.lineno - 1:
            above = previous_above
        result[node.target.id] = " ".join(above + own)
        previous_end, previous_above = node.end_lineno, above
    return result


def default_of(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory()!r}`"
    return f'`"{f.default}"`' if isinstance(f.default, str) else f"`{f.default!r}`"


def allowed_of(f: dataclasses.Field) -> str:
    choices, minimum = f.metadata.get("choices"), f.metadata.get("minimum")
    parts = []
    if choices:
        parts.append(", ".join(f"`{c}`" for c in choices))
    if minimum is not None:
        parts.append(f">= {minimum}")
    return "; ".join(parts)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def section_table(name: str, cls: type) -> list[str]:
    comments = field_comments(cls)
    out = [f"## `{name}`", ""]
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # the dataclass's own repr doc
        out += [inspect.cleandoc(cls.__doc__), ""]
    out += ["| field | type | default | allowed | environment | meaning |", "|---|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        env = f"{environment.ENV_PREFIX}{name.upper()}_{f.name.upper()}"
        row = [f"`{name}.{f.name}`", f"`{f.type}`", default_of(f), allowed_of(f), f"`{env}`", comments.get(f.name, "")]
        out.append("| " + " | ".join(cell(c) for c in row) + " |")
    return out + [""]


def render() -> str:
    out = [HEADER]
    for section in dataclasses.fields(schema.PdserveConfig):
        out += section_table(section.name, type(getattr(schema.PdserveConfig(), section.name)))
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
