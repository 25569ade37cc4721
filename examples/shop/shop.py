"""A small shop, as a user brings an environment nobody labelled: a plain class whose
public, typed and documented methods are the tools, and whose public attributes are the
state (docs/environments.md)."""

from __future__ import annotations

from typing import Any


class Shop:
    """A shop with a stock, prices, one cart and the orders placed."""

    def __init__(self) -> None:
        self.stock: dict[str, int] = {"apple": 5, "pear": 2, "milk": 3}
        self.prices: dict[str, float] = {"apple": 0.5, "pear": 0.8, "milk": 1.2}
        self.cart: dict[str, int] = {}
        self.orders: list[dict[str, Any]] = []

    def list_items(self) -> dict[str, int]:
        """The items in stock, each with the quantity left."""
        return {item: count for item, count in self.stock.items() if count > 0}

    def price_of(self, item: str) -> float:
        """The price of one unit of an item."""
        if item not in self.prices:
            raise KeyError(f"no item called {item!r}")
        return self.prices[item]

    def add_to_cart(self, item: str, quantity: int = 1) -> dict[str, int]:
        """Put a quantity of an item in the cart, taking it from the stock."""
        if quantity < 1:
            raise ValueError("quantity must be at least 1")
        if self.stock.get(item, 0) < quantity:
            raise ValueError(f"not enough {item} in stock")
        self.stock[item] -= quantity
        self.cart[item] = self.cart.get(item, 0) + quantity
        return dict(self.cart)

    def remove_from_cart(self, item: str) -> dict[str, int]:
        """Take an item out of the cart and put it back in the stock."""
        if item not in self.cart:
            raise KeyError(f"no {item} in the cart")
        self.stock[item] = self.stock.get(item, 0) + self.cart.pop(item)
        return dict(self.cart)

    def checkout(self) -> dict[str, Any]:
        """Pay for the cart: it becomes an order with its total, and the cart is emptied."""
        if not self.cart:
            raise ValueError("the cart is empty")
        total = round(sum(self.prices[item] * n for item, n in self.cart.items()), 2)
        order = {"number": len(self.orders) + 1, "items": dict(self.cart), "total": total}
        self.orders.append(order)
        self.cart = {}
        return order
