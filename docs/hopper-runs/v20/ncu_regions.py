import csv,gzip,sys
rows=list(csv.reader(gzip.open(sys.argv[1],'rt')))
hdr=rows[1]; data=rows[2:]
ix={h:i for i,h in enumerate(hdr)}
S=lambda r:int(r[ix['Warp Stall Sampling (All Samples)']])
tot=sum(S(r) for r in data)
regs=[('pre',0,1639),('kwait+turn',1640,1666),('issueS',1667,1714),('vwait',1715,1718),('issuePV',1719,1750),('Swait',1751,1762),('gap',1763,2618),('max',2619,2719),('exp',2720,2916),('PVwait',2917,2986),('convert',2987,3024),('post',3025,4440)]
for n,a,b in regs:
    s=sum(S(r) for r in data[a:b+1]); print(f"{n:12s} {s:7d} {100*s/tot:5.1f}%")
for a,b in [(1763,2618),(2697,2719),(2917,2986)]:
  for n in range(a,b+1):
    r=data[n]
    if S(r)>40: print(n,S(r),r[ix['Instructions Executed']],r[ix['Source']].strip()[:70])
