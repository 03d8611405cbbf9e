"""Operator tools: what ``elastic-rt status`` and ``elastic-rt timeline`` show a person.

They read a run's etcd keys and event files and never change a run; nothing in the
runtime (worker, agent, rendezvous) imports them.
"""
