"""The Qt-free live state the views read: the engine's events folded into ring buffers, the
page map, request and group views. Arrows: engine.events -> live -> widgets -> app."""
