"""The views of the model's inside: the logit lens, every head's attention, expert routes, scoring
a text and steering, each asked of the engine on demand (engine.api's EngineClient questions)
and drawn by its panel in widgets/."""
