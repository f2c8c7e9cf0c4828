"""An emulated multi-node cluster on one machine: network namespaces joined by rate-shaped links.

``poise cluster up`` builds one (:mod:`poise.cluster.topology`, recorded first in
:mod:`poise.cluster.state`), ``poise train --cluster N:M`` or ``poise cluster run`` runs a real
multi-node job across it (launched from above by :mod:`poise.launch.cluster_job`, one torch
elastic agent per node), and ``poise cluster check`` measures its links
(:mod:`poise.cluster.linkcheck`). Needs root, ``ip`` and ``tc`` (:mod:`poise.cluster.net`).
"""
