"""The search: intra-op sharding ILP, inter-op stage DP, outer enumeration."""
