"""A real WAN testbed on one machine: network namespaces, rate-limited links, real processes.

* :mod:`fedddl.testbed.netns` - namespaces, veth links, ``tc`` shaping, counters, clean-up;
* :mod:`fedddl.testbed.flower_run` - a TLS Flower deployment, one SuperNode per namespace;
* :mod:`fedddl.testbed.gossip_run` - real gossip peers, one per namespace;
* :mod:`fedddl.testbed.predict` - what ``fedddl.network`` / the gossip simulator predict;
* :mod:`fedddl.testbed.compare` - side-by-side runs and their summaries (``fedddl testbed``).

Importing the package imports nothing heavy; see docs/testbed.md.
"""
