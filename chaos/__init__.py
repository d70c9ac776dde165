"""The four faults, one module each, as plain functions with JSON arguments.

Every module has ``steady_state`` (a probe returning a bool or a value),
``inject`` and ``revert``, all taking ``kubeconfig`` (a path; empty for the
usual kubeconfig resolution), ``context`` (a context of that kubeconfig;
empty for its current context) and names of objects. Every public function
that reaches the cluster takes both and passes both on, and every experiment
declares both as configuration (``context`` defaults to ""), so a fault acts
on the cluster that was certified (``--context``), never merely on the
kubeconfig's current context. They act only through the Kubernetes API, so
they behave the same on every platform. The pytest clauses run them through
chaostoolkit's runner (:mod:`chaos.runner`) from the experiments in
``chaos/experiments/``; the same files run from the command line:

    chaos run chaos/experiments/preempt-worker.json --var kubeconfig=$KUBECONFIG \\
        --var context=gpu-east --var namespace=team-a --var cluster=train-abc12

| module | fault |
| --- | --- |
| ``straggler`` | one worker of a gang delayed before Ready (slow image pull) or never pullable |
| ``preempt_worker`` | a worker pod deleted mid-all-reduce (spot reclaim, preemption) |
| ``head_oom`` | the head pushed past its memory limit by a job submitted to the running cluster |
| ``block_collectives`` | a NetworkPolicy that drops worker-to-worker traffic (a security tightening) |
"""
