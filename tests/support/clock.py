"""A clock the test moves by hand (`clock.t += 0.5`), for code that takes a `clock=` callable."""


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t
