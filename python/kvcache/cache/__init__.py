"""The manager API: configuration, memory sizing and window shares, the
:class:`KVCacheManager` facade over the native core, block keys and argument checks."""
