"""The bench: ``hybrid-alloc bench``, ``hybrid-alloc hits`` and ``hybrid-alloc capacity``
(``hybrid_alloc.cli``), and the offline scheduler the tests build too. Nothing outside this
folder imports it: ``import hybrid_alloc`` and ``import hybrid_alloc.vllm`` load none of it.
Importing this package imports nothing; every module imports vLLM only inside the functions
that run it.

| module | holds |
|---|---|
| ``shapes.py`` | the model shapes, one registry for every bench (``SHAPES``, ``ALIASES``), and vLLM's Hopper block size |
| ``offline.py`` | vLLM's real ``Scheduler`` built without a GPU for a model shape, fabricated model outputs |
| ``common.py`` | the vLLM check and its install hint, the table renderer (80 columns or the terminal's), the plot backend |
| ``clock.py`` | ``ManagerClock``: what the scheduler pays for a manager, call by call, its own cost subtracted |
| ``floor.py`` | the ``floor`` probe (``--managers ...,floor``), present only in the probe build |
| ``runner.py`` | ``run_scenario``: one scenario under one manager, timed and bare steps alternating |
| ``serve.py`` | the ``serve`` workload (the closed loop) and its table |
| ``memory.py`` | the ``memory`` workload: construction time and bytes per block, one interpreter each |
| ``main.py`` | ``hybrid-alloc bench``: the scenarios, the options, the tables, the JSON and the plot |
| ``hits_workloads.py`` | the hits bench's workloads, the shapes ``--shape`` names, the pool budgets |
| ``hits_measure.py`` | what a hits cell measures beyond vLLM's stats (shares, refusals, hint counters), the simulated clock |
| ``hits_run.py`` | one hits cell on vLLM's real scheduler under one retention policy, and its ``Result`` |
| ``hits_report.py`` | the hits bench's progress lines, tables, ``hits.json`` and ``hits.png`` |
| ``hits.py`` | ``hybrid-alloc hits``: prefix-cache hits by retention policy, the options and the cells |
| ``capacity_run.py`` | one capacity run: a closed-loop trace under vLLM's manager, ours or ours with two-level pages, and its ``Result`` |
| ``capacity.py`` | ``hybrid-alloc capacity``: requests that fit at equal memory on state-space hybrids, the table, ``capacity.json``, ``capacity.png`` |

Imports go down the table: ``main`` imports ``serve``, ``memory``, ``runner``, ``floor`` and
``common``; ``serve`` imports ``runner`` and ``common``; ``runner`` imports ``clock`` and
``floor``; ``hits`` imports ``hits_report``, ``hits_run``, ``hits_workloads`` and ``common``,
``hits_report`` imports ``hits_run``, ``hits_workloads`` and ``common``, ``hits_run`` imports
``hits_measure``, ``hits_workloads`` and ``common``, ``hits_measure`` imports ``hits_workloads``;
``capacity`` imports ``capacity_run`` and ``common``, ``capacity_run`` imports ``common``;
``memory`` imports ``common``; ``offline`` imports ``shapes``; both are imported inside the
functions that build a scheduler or look a shape up (``shapes`` loads torch, ``offline`` vLLM).
``tests/python/core/test_imports.py`` checks there is no circle.
"""
