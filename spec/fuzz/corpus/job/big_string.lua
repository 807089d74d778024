local s = ("x"):rep(1e10)
return { data = s }
