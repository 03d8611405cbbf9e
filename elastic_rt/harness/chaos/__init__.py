"""The chaos matrix: every fault of DESIGN section 7, injected into real 3-node jobs.

``scripts/chaos.py`` is its command line; ``tests/integration/test_chaos.py`` runs
one trial of four faults. The modules, one concern each:

- :mod:`.config`: how big each job is and how fast the runtime reacts;
- :mod:`.audit`: pure pass/fail decisions over event logs (lost, repeated, stale);
- :mod:`.trial`: one trial's jobs, their nodes and events, and its findings;
- :mod:`.faults`: the faults themselves, by name (:data:`.faults.FAULTS`);
- :mod:`.netns`: the network-namespace plumbing of the cut-off fault;
- :mod:`.run`: one trial end to end, the reference run, and the leftovers sweep;
- :mod:`.report`: the results table.
"""
