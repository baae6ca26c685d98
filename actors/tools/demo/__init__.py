"""The demo job and what it is built from: a fleet of trainers and engines on Ray
(:mod:`actors.tools.demo.fleet`: ``Fleet``, ``start_fleet``, ``connect_ray``, ``run_job``), the
checks of every update (:mod:`~actors.tools.demo.checks`, :mod:`~actors.tools.demo.verify`), the
same against a real vLLM (:mod:`~actors.tools.demo.vllm_demo`), an RL loop
(:mod:`~actors.tools.demo.rl_loop`), fault drills and soak runs (:mod:`~actors.tools.demo.chaos`,
:mod:`~actors.tools.demo.soak`) and the ``ray job submit`` entry (:mod:`~actors.tools.demo.launch`).
The ``wt`` command line (:mod:`actors.tools.cli`) calls into these.
"""
