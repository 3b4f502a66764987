"""Programs that attack the machine that runs them, for the sandbox's tests.

Each is a template: ``{run}`` (the run directory), ``{home}`` (the home directory), ``{port}`` (a TCP listener
the test opens on 127.0.0.1), ``{marker}`` (a string put on the command line of every process the program
starts, so that a survivor can be found in /proc) are filled in by :func:`program`. ``attack_reward`` scores
completions by running the program the record's ``attack`` column names, through the code reward's sandbox:
the battery inside a training run.
"""

from __future__ import annotations

import os
import textwrap

from grpolab.rewards.code import CodeReward

ATTACKS = {
    "infinite_loop": "while True:\n    pass\n",
    "fork_bomb": textwrap.dedent(
        """\
        import os, sys
        sys.argv.append("{marker}")
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """
    ),
    "allocate_10gb": "x = bytearray(10 * 1024 ** 3)\nx[-1] = 1\n",
    "write_10gb_file": textwrap.dedent(
        """\
        block = b"\\0" * (1 << 20)
        with open("big.bin", "wb") as f:
            for _ in range(10 * 1024):
                f.write(block)
        """
    ),
    "write_run_dir": "open('{run}/pwned.txt', 'w').write('pwned')\n",
    "write_home_dir": "open('{home}/pwned-{marker}.txt', 'w').write('pwned')\n",
    "read_trainer_env": "import os\nassert os.environ.get('GRPOLAB_TEST_SECRET') == 'hunter2'\n",
    "connect_listener": textwrap.dedent(
        """\
        import socket
        s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
        s.sendall(b"hello from the sandbox")
        """
    ),
    "kill_parent": "import os\nos.kill(os.getppid(), 9)\n",
    "ignore_sigterm_and_sleep": "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n",
    "daemon": textwrap.dedent(
        """\
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)", "{marker}"],
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
        """
    ),
    "print_1gb": "chunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    print(chunk)\n",
}


def program(name: str, run: str = "/nonexistent", home: str = "", port: int = 9, marker: str = "grpolab-attack") -> str:
    return ATTACKS[name].format(run=run, home=home or os.path.expanduser("~"), port=port, marker=marker)


class AttackReward(CodeReward):
    """The code reward of the attack program named in each record (the completion itself is ignored). A subclass of
    the code reward: a run gives it its own sandbox, made from its options, as it gives the code reward; the labels
    of the sandboxes it made are kept (``labels``), so that a test can look for processes they left behind."""

    __name__ = "attack_reward"
    columns = None  # TRL form: the columns its parameters name
    labels: list[str] = []

    def sandbox(self):
        sandbox = super().sandbox()
        if sandbox.label not in AttackReward.labels:
            AttackReward.labels.append(sandbox.label)
        return sandbox

    def __call__(self, prompts, completions, attack, run, port, marker, **kwargs) -> list[float]:
        fenced = [f"```python\n{program(a, r, port=p, marker=m)}```" for a, r, p, m in zip(attack, run, port, marker)]
        return super().__call__(prompts, fenced, kwargs.get("tests"))


attack_reward = AttackReward()
