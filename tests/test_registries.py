"""Each registry of pluggable pieces (KV transports, tool-call parsers, reasoning parsers) and the config
choices that name them agree: configs/ may not import the packages that hold them, so the names are
written twice, and a piece added to one place only is caught here."""

from __future__ import annotations

import dataclasses

from configs.schema import GatewayConfig, TransferConfig
from gateway.text.reasoning import PARSERS as REASONING_PARSERS
from gateway.text.tool_parsers import PARSERS as TOOL_CALL_PARSERS
from kvtransfer.transports import FALLBACK, TRANSPORTS


def choices(config_class, name: str) -> tuple:
    return next(f for f in dataclasses.fields(config_class) if f.name == name).metadata["choices"]


def test_every_transport_is_a_config_choice_and_back():
    assert set(choices(TransferConfig, "transport")) == {"auto", *TRANSPORTS}
    assert all(name == t.name for name, t in TRANSPORTS.items()) and FALLBACK in TRANSPORTS


def test_every_tool_call_parser_is_a_config_choice_and_back():
    assert choices(GatewayConfig, "tool_call_parser") == ("none", *TOOL_CALL_PARSERS)


def test_every_reasoning_parser_is_a_config_choice_and_back():
    assert choices(GatewayConfig, "reasoning_parser") == ("none", *REASONING_PARSERS)
