"""The sge backend: the whole job as one SGE parallel-environment job (``--launcher sge``).

``backend`` is pslaunch's side (``qsub``, waiting, output, ``qdel``; the registry loads
``SgeBackend`` from it); ``job`` is what runs inside the job on the cluster (the job's master task
and the per-host agents it starts with ``qrsh -inherit``). They talk through files in a private
directory in pslaunch's working directory, which the job's hosts share (as ``qsub -cwd`` needs).
This file imports neither, so that ``python -m launcher.backends.sge.job`` loads only ``job``.
"""
