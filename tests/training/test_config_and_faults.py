"""Config and fault-spec validation: clear errors, and the config-error exit code from both CLIs."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from training.local import cli as local
from training.local.shape import ClusterShape
from training.pod import launch, store
from training.train import trainer as train
from training.contract.config import (CheckpointConfig, FaultToleranceConfig, ParallelConfig, TrainConfig,
                                      TrainConfigError, load_train_config)
from training.contract.exit_codes import CONFIG_ERROR
from training.contract.faults import KINDS, FaultSpecError, parse_fault, parse_faults
from training_helpers import exit_code


@pytest.mark.parametrize("overrides, message", [
    (["checkpoint.mode=fast"], "checkpoint.mode='fast' is not allowed: one of ['sync', 'async', 'off']"),
    (["checkpoint.when_busy=drop"], "checkpoint.when_busy='drop' is not allowed: one of ['wait', 'skip']"),
    (["data.dtype=int8"], "data.dtype='int8'"),
    (["checkpoint.save_final=maybe"], "checkpoint.save_final='maybe': expected true or false"),
    (["logging.sampel_log=true"], "unknown key(s) ['logging.sampel_log']"),
    (["model.preset=70b"], "one of ['tiny', 'small', '1b', '8b']"),
    (["fault_tolerance.rendezvous_join_timeout_s=10"],
     "fault_tolerance.rendezvous_join_timeout_s=10.0 is not allowed: at least 60 seconds"),
    (["fault_tolerance.rank_check_interval_s=0"],
     "fault_tolerance.rank_check_interval_s=0.0 is not allowed: greater than 0 seconds"),
    (["fault_tolerance.rendezvous_last_call_s=-1"], "fault_tolerance.rendezvous_last_call_s=-1 is not allowed: 0 or more"),
    (["fault_tolerance.rendezvous_last_call_s=2.5"], "fault_tolerance.rendezvous_last_call_s=2.5: expected a whole number"),
    (["training.global_batch_size=0"], "training.global_batch_size=0 is not allowed: a positive multiple of "
                                       "training.batch_size (4)"),
    (["training.global_batch_size=-8"], "training.global_batch_size=-8 is not allowed: a positive multiple"),
    (["training.global_batch_size=10"], "training.global_batch_size=10 is not allowed: a positive multiple of "
                                        "training.batch_size (4), which each rank's micro-batches fill, e.g. 8 or 12"),
    (["training.global_batch_size=many"], "training.global_batch_size='many': expected a whole number"),
    (["parallel.replica_groups=2", "parallel.quorum_timeout_s=300"],
     "parallel.quorum_timeout_s=300.0 is not allowed: less than 300 s, the least of fault_tolerance."
     "setup_section_timeout=600, rank_heartbeat_timeout=300, out_of_section_timeout=600: NVRx would end a rank's "
     "wait for its quorum first"),
])
def test_bad_config_values_are_named(overrides, message):
    with pytest.raises(TrainConfigError) as err:
        load_train_config(None, overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("make, message", [
    (lambda: FaultToleranceConfig(max_restarts=-1), "fault_tolerance.max_restarts=-1 is not allowed: 0 or more"),
    (lambda: CheckpointConfig(mode="fast"), "checkpoint.mode='fast' is not allowed: one of ['sync', 'async', 'off']"),
    (lambda: dataclasses.replace(ParallelConfig(), quorum_timeout_s=0.5),
     "parallel.quorum_timeout_s=0.5 is not allowed: more than heartbeat_timeout_s (1.0)"),
])
def test_a_section_made_in_code_is_held_to_the_files_rules(make, message):
    with pytest.raises(TrainConfigError) as err:
        make()
    assert message in str(err.value)


def _config_keys(cls: type = TrainConfig, prefix: str = "") -> dict[str, typing.Any]:
    """section.key -> type of every training config key, found from the dataclasses."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, typing.Any] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= _config_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys[prefix + f.name] = hints[f.name]
    return keys


# section.key -> allowed values, for every key whose type (or optional type) is a Literal
CLOSED_SETS = {key: typing.get_args(literal) for key, hint in _config_keys().items()
               for literal in (hint, *typing.get_args(hint)) if typing.get_origin(literal) is typing.Literal}


def test_every_closed_set_is_a_literal_type():
    assert {"model.preset", "training.device", "data.dtype", "checkpoint.mode", "checkpoint.when_busy",
            "fault_tolerance.restart"} <= set(CLOSED_SETS)


@pytest.mark.parametrize("key, allowed", CLOSED_SETS.items(), ids=list(CLOSED_SETS))
def test_a_closed_set_refuses_a_value_outside_it(key, allowed):
    with pytest.raises(TrainConfigError) as err:
        load_train_config(None, [f"{key}=not-a-choice"])
    assert f"{key}='not-a-choice' is not allowed: one of {list(allowed)}" in str(err.value)


@pytest.mark.parametrize("main", [train.main, local.main, launch.parse_args, store.main],
                         ids=["train", "local", "launch", "store"])
def test_help_lists_every_config_key_with_its_allowed_values(main, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {key}: " in out for key in _config_keys()), out
    assert "  checkpoint.mode: sync | async | off = async\n" in out
    assert "  data.dtype: uint16 | uint32 | null = null\n" in out


def test_new_config_keys_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint: {when_busy: skip, save_final: true}\ndata: {dtype: uint32}\nlogging: {sample_log: true}\n")
    cfg = load_train_config(path)
    assert (cfg.checkpoint.when_busy, cfg.checkpoint.save_final, cfg.data.dtype, cfg.logging.sample_log) == \
        ("skip", True, "uint32", True)


def test_values_read_as_written_in_overrides_and_files(tmp_path):
    # YAML 1.1 would turn `off` into False and leave 1e-3 a string; a user means the mode and the number.
    cfg = load_train_config(None, ["checkpoint.mode=off", "training.lr=1e-3", "checkpoint.save_final=true"])
    assert (cfg.checkpoint.mode, cfg.training.lr, cfg.checkpoint.save_final) == ("off", 1e-3, True)
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  mode: off\n")
    assert load_train_config(path).checkpoint.mode == "off"
    with pytest.raises(TrainConfigError, match="checkpoint.save_final='yes': expected true or false"):
        load_train_config(None, ["checkpoint.save_final=yes"])


def test_fault_spec_parses():
    spec = parse_fault("sigkill@60:rank=3")
    assert (spec.kind, spec.step, spec.rank, spec.key) == ("sigkill", 60, 3, "sigkill@60_rank=3")
    assert parse_fault("exception@5").rank == 0


@pytest.mark.parametrize("text, problem", [
    ("segfault@3", "unknown kind 'segfault'"),
    ("exception", "not of the form KIND@STEP"),
    ("exception@x", "step 'x' is not a whole number"),
    ("exception@0", "step must be at least 1"),
    ("exception@3:node=1", "unknown option 'node' for exception"),
    ("exception@3:rank=-1", "rank='-1' is not a rank number"),
    ("exception@3:rank", "option 'rank' is not key=value"),
])
def test_bad_fault_specs_are_rejected_clearly(text, problem):
    with pytest.raises(FaultSpecError) as err:
        parse_fault(text)
    message = str(err.value)
    assert repr(text) in message and problem in message
    if "kind" in problem or "form" in problem:
        assert all(kind in message for kind in KINDS)


def test_fault_rank_must_exist_and_specs_must_be_unique():
    with pytest.raises(FaultSpecError, match="rank 4 does not exist"):
        parse_faults(["exception@3:rank=4"], world_size=4)
    with pytest.raises(FaultSpecError, match="repeated"):
        parse_faults(["exception@3:rank=1", "exception@3:rank=1"])


def test_train_cli_exits_with_config_error(capsys):
    assert exit_code(train.main, ["checkpoint.mode=fast"]) == CONFIG_ERROR
    assert exit_code(train.main, ["faults=[boom@3]"]) == CONFIG_ERROR
    assert "unknown kind 'boom'" in capsys.readouterr().err


def test_local_cli_exits_with_config_error_before_starting_anything(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert exit_code(local.main, ["--run-dir", str(run_dir), "--nodes", "1", "--nproc-per-node", "2",
                                  "--faults", "sigkill@3:rank=2"]) == CONFIG_ERROR
    assert "rank 2 does not exist (world size 2)" in capsys.readouterr().err
    assert not (run_dir / "logs").exists()


def test_a_global_batch_is_filled_by_micro_batches_at_every_world_size_that_divides_it():
    t = load_train_config(None, ["training.batch_size=2", "training.global_batch_size=24"]).training
    assert [(w, t.accumulation_steps(w)) for w in (1, 2, 3, 4, 6, 12)] == [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2),
                                                                            (12, 1)]
    assert {t.global_batch(w) for w in (1, 2, 3, 4, 6, 12)} == {24}
    with pytest.raises(TrainConfigError) as err:
        t.accumulation_steps(5)
    assert str(err.value) == ("training.global_batch_size=24 cannot be reached by world size 5: the global batch is "
                              "world size x batch_size (2) x micro-batches per rank, so the world size must divide 12; "
                              "allowed world sizes: [1, 2, 3, 4, 6, 12]")
    default = load_train_config(None, ["training.batch_size=2"]).training  # as before: one micro-batch per rank
    assert [(default.accumulation_steps(w), default.global_batch(w)) for w in (2, 5)] == [(1, 4), (1, 10)]


def test_local_cli_refuses_a_world_that_cannot_reach_the_global_batch_before_starting_anything(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert exit_code(local.main, ["--run-dir", str(run_dir), "--nodes", "5", "--nproc-per-node", "1",
                                  "training.batch_size=2", "training.global_batch_size=24"]) == CONFIG_ERROR
    assert ("training.global_batch_size=24 cannot be reached by world size 5" in capsys.readouterr().err)
    assert not run_dir.exists()


@pytest.mark.parametrize("main, argv", [(train.main, ["--bogus"]), (local.main, ["--nodes", "0"]),
                                        (local.main, ["--nodes", "two"]), (local.main, ["--spares", "-1"]),
                                        (local.main, ["--replacement-delay", "-5"])])
def test_bad_cli_flags_exit_with_config_error(main, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == CONFIG_ERROR
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("shape", [ClusterShape(), ClusterShape(nodes=4, nproc_per_node=1, spares=1,
                                                 replacement_delay_s=2.5, node_retries=0, replica_groups=2,
                                                 netns=True)])
def test_a_cluster_shape_is_the_one_its_flags_give(shape):
    # the bench and the tests start a cluster with a shape's flags; the command line reads the same shape back
    assert local.parse_args(list(shape.argv())).shape == shape
    assert shape.of_group(2) == dataclasses.replace(shape, nodes=shape.nodes // 2, replica_groups=1)
