return ("x"):rep(3)
