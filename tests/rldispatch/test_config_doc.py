"""docs/configuration.md's key table is the code's: every key, its type, default and meaning, from the dataclasses."""
from pathlib import Path

from protocol.config import to_plain
from rldispatch.cli import main as cli_main
from rldispatch.commands.config import config_rows, config_table, table_in_doc
from rldispatch.config import RunConfig
from rldispatch.run_dir import flatten

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_documented_table_is_the_generated_one():
    text = DOC.read_text(encoding="utf-8")
    start, end = table_in_doc(text, str(DOC))
    assert text[start:end].strip() == config_table().strip(), \
        "docs/configuration.md is stale: run `rldispatch config --table --update docs/configuration.md`"


def test_the_table_has_every_key_once_with_its_default():
    rows = list(config_rows())
    keys = [k for k, *_ in rows]
    assert len(keys) == len(set(keys))
    defaults = flatten(to_plain(RunConfig()))
    # flatten() has no entry for an empty mapping (reward_kwargs: {}); the table keeps it as a key
    assert {k: d for k, _, d, _ in rows if d != {}} == defaults
    meaning = {k: m for k, _, _, m in rows}
    assert meaning["rollout.n"] == "sessions per prompt (GRPO group size)"  # a field's trailing comment


def test_config_command_prints_the_resolved_config(capsys):
    import yaml

    assert cli_main(["config", "--config", "grpo_tiny", "trainer.total_steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["total_steps"] == 7 and printed["actor"]["backend"] == "fsdp"
    assert cli_main(["config", "--config", "grpo_tiny", "actor.backend=tpu"]) == 2
    assert "config error: actor.backend must be one of" in capsys.readouterr().err
