"""Reading a config: YAML -> validated ``RdserveConfig``, with one line per problem naming the field."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from cluster.config.base import ConfigError
from cluster.config.rdserve import RdserveConfig


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: ``dotted.field: pydantic message (got VALUE)``, the value where it is a scalar."""
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]).replace(".[key]", " (key)")  # a mapping's key is what is wrong
        own = e["msg"].removeprefix("Value error, ")
        if own != e["msg"] and (not field or own.startswith(field + ".")):  # a section's or cross-section check:
            lines.append(own)                                                # its message names the field
            continue
        given = e.get("input")
        got = f" (got {given!r})" if isinstance(given, (str, int, float, bool)) and repr(given) not in own else ""
        lines.append(f"{field or '(top level)'}: {own}{got}")
    return "\n".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one, so a
    second ``speculation:`` pasted at the end of a file would silently replace the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping (merge the two)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_config(data: dict, base_dir: Path) -> RdserveConfig:
    """Validate a mapping; relative paths resolve against ``base_dir``.

    Raises:
        ConfigError: naming each offending field.
    """
    try:
        return RdserveConfig.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(path: str | Path) -> RdserveConfig:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: unreadable file, invalid YAML, or invalid fields (each named).
    """
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    try:
        return parse_config(data, path.resolve().parent)
    except ConfigError as err:
        raise ConfigError(f"{path}:\n{err}") from None
