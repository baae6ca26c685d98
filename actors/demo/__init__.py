"""The demo job and what it is built from: a fleet of trainers and engines on Ray
(:mod:`actors.demo.fleet`: ``Fleet``, ``start_fleet``, ``connect_ray``, ``run_job``), the
checks of every update (:mod:`~actors.demo.checks`, :mod:`~actors.demo.verify`), the
same against a real vLLM (:mod:`~actors.demo.vllm_demo`), an RL loop
(:mod:`~actors.demo.rl_loop`), fault drills and soak runs (:mod:`~actors.demo.chaos`,
:mod:`~actors.demo.soak`) and the ``ray job submit`` entry (:mod:`~actors.demo.launch`).
The ``wt`` command line (:mod:`actors.cli`) calls into these.
"""
