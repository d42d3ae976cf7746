"""The cluster simulator: the runtime's scheduling policies on a simulated clock and a cost model.

``costmodel.py`` loads a preset (cluster, models and their costs, agents, graph, workload); ``engine.py``
runs one mode of it as a discrete-event simulation; ``experiments.py`` runs the modes, compares them with the
paper and sweeps agents and devices; ``calibrate.py`` measures a cost model on this machine.
"""
