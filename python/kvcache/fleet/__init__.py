"""Several engines behind a router: KV events (``kvcache.events``), the router index
(``kvcache.router``) and the fleet-wide shared tier (``kvcache.shared_cache``)."""
