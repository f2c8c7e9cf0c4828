"""An emulated multi-node cluster on one machine: network namespaces joined by rate-shaped links.

``poise cluster up`` builds one (:mod:`poise.cluster.topology`, recorded first in
:mod:`poise.cluster.state`), ``poise train --cluster N:M`` or ``poise cluster run`` runs a real
multi-node job across it (:mod:`poise.cluster.job`, one torch elastic agent per node through
:mod:`poise.cluster.agent`), and ``poise cluster check`` measures its links
(:mod:`poise.cluster.linkcheck`). Needs root, ``ip`` and ``tc`` (:mod:`poise.cluster.net`).
"""
