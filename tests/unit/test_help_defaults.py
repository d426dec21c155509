"""Every command's help shows each option's real default, and never "(default: None)"."""

from __future__ import annotations

import argparse

import pytest

from aggregator_service.__main__ import build_parser as aggregator_parser
from agent_service.__main__ import build_parser as agent_parser
from evaluator_service.__main__ import build_parser as evaluator_parser
from fedrl.cli import build_parser as fedrl_parser


def parsers():
    out = [("fedrl-aggregator", aggregator_parser()), ("fedrl-agent", agent_parser()),
           ("fedrl-evaluator", evaluator_parser())]
    todo = [("fedrl", fedrl_parser())]
    while todo:
        name, p = todo.pop()
        out.append((name, p))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {n}", sp) for n, sp in a.choices.items()]
    return out


@pytest.mark.parametrize("name,parser", parsers(), ids=[n for n, _ in parsers()])
def test_help_shows_real_defaults(name, parser):
    text = parser.format_help()
    assert "(default: None)" not in text, name
    for a in parser._actions:
        d = a.default
        if (not a.option_strings or a.required or d in (None, False, argparse.SUPPRESS) or a.help == argparse.SUPPRESS
                or isinstance(d, list) and not d):
            continue
        shown = a.help and "default" in a.help.lower()
        assert shown or f"(default: {d})" in " ".join(text.split()), (name, a.option_strings, d)


@pytest.mark.parametrize("name,parser", parsers(), ids=[n for n, _ in parsers()])
def test_an_option_without_a_default_value_says_what_leaving_it_out_means(name, parser):
    """``fedrl up --help`` showed nothing for --algo and --seed (their defaults come from the run
    config): an option whose default is None must say in its help what it is left out."""
    for a in parser._actions:
        if a.option_strings and a.default is None and not a.required and a.nargs != 0 and a.help != argparse.SUPPRESS:
            assert a.help, (name, a.option_strings)
