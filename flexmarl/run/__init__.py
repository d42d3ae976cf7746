"""A run directory: its layout (``layout.py``, named once), starting a run in it (``plan.py`` decides and
checks, ``prepare.py`` writes), read access to a finished or running run (``directory.py``), the timeline
file (``timeline_file.py``) and exporting an agent (``export.py``).

The runtime writes a run directory and the report reads it; both import the layout from here. Reading a run
imports neither Dask nor torch.
"""
