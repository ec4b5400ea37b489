"""The allow-listed environments of reward workers and sandboxed programs."""

from __future__ import annotations

from asyncrl.tasks.reward.environ import SANDBOX_ENV, sandbox_setenv_args, worker_environment


def test_worker_environment_keeps_only_the_allow_list() -> None:
    environ = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONPATH": "/src",
        "TMPDIR": "/scratch",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "ASYNCRL_ROLLOUT_API_KEY": "secret",
        "ASYNCRL_REWARD_TOKEN": "secret",
        "HF_TOKEN": "secret",
        "PYTHONSTARTUP": "/home/x/evil.py",
        "LD_PRELOAD": "/tmp/evil.so",
    }
    assert worker_environment(environ) == {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONPATH": "/src",
        "TMPDIR": "/scratch",
    }


def test_sandbox_setenv_args_clear_then_set_exactly_the_sandbox_env() -> None:
    args = sandbox_setenv_args()
    assert args[0] == "--clearenv"
    triples = [args[i : i + 3] for i in range(1, len(args), 3)]
    assert all(t[0] == "--setenv" for t in triples)
    assert {name: value for _, name, value in triples} == dict(SANDBOX_ENV)
    assert SANDBOX_ENV["HOME"] == "/tmp" and "/usr/bin" in SANDBOX_ENV["PATH"]
