"""docs/configuration.md is generated from configs/schema.py; this fails when the two differ."""

from pathlib import Path

from configs import docgen, schema

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_configuration_page_is_the_generators_output():
    assert PAGE.read_text(encoding="utf-8") == docgen.render(), (
        f"docs/configuration.md is out of date with configs/schema.py; regenerate it: {docgen.COMMAND}"
    )


def test_page_names_every_field_with_its_default_and_env_variable():
    # Independent of the generator's layout: walk the schema and look for each field's row.
    page = PAGE.read_text(encoding="utf-8")
    config = schema.PdserveConfig()
    for section in schema.PdserveConfig.__dataclass_fields__:
        for name in getattr(config, section).__dataclass_fields__:
            rows = [line for line in page.splitlines() if line.startswith(f"| `{section}.{name}` |")]
            assert len(rows) == 1, f"{section}.{name}: {len(rows)} rows"
            assert f"`PDSERVE_{section.upper()}_{name.upper()}`" in rows[0]
            default = getattr(getattr(config, section), name)
            assert (f'`"{default}"`' if isinstance(default, str) else f"`{default!r}`") in rows[0]
