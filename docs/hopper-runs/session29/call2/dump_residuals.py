#!/usr/bin/env python3
"""Session 29, call 2: which tiles of a hopper_trace --timeline dump (ATTND_TRACE_DUMP) run over their length.

  python3 dump_residuals.py dump_c16k.csv.gz FIRST_TAIL_ROUND   (14 for d128 causal 16k; whole tiles only)
Fits a tile's time to a + b * key blocks over the whole tiles, then prints the residuals by tile length, by round and
by block, how well a block's residual in the first half predicts the second, and the largest ones.
"""
import csv, collections, gzip, sys
cols="cfg,b,s,h,causal,blk,r,qt,head,batch,nb,pf,sm1,sm2,start,dur".split(',')
def load(n):
    rows=[dict(zip(cols,r)) for r in csv.reader(gzip.open(n, 'rt') if n.endswith('.gz') else open(n))]
    for x in rows:
        for k in cols[1:14]: x[k]=int(x[k])
        x['start']=float(x['start']); x['dur']=float(x['dur'])
    return rows
def fit(pts):
    n=len(pts); sx=sum(p[0] for p in pts); sy=sum(p[1] for p in pts)
    sxx=sum(p[0]*p[0] for p in pts); sxy=sum(p[0]*p[1] for p in pts)
    a=(n*sxy-sx*sy)/(n*sxx-sx*sx); c=(sy-a*sx)/n; return a,c
name=sys.argv[1]; tail=int(sys.argv[2])
rows=load(name)
whole=[x for x in rows if x['r']<tail]
a,c=fit([(x['nb'],x['dur']) for x in whole]); print("fit dur = %.4f us/blk * nb + %.2f"%(a,c))
for x in whole: x['res']=x['dur']-(a*x['nb']+c); x['rate']=x['dur']/x['nb']
# residual by nb bucket
bk=collections.defaultdict(list)
for x in whole: bk[x['nb']//16].append(x['res'])
print("residual by nb/16:", {k*16:round(sum(v)/len(v),2) for k,v in sorted(bk.items())})
# residual by round
br=collections.defaultdict(list)
for x in whole: br[x['r']].append(x['res'])
print("residual by round:", {k:round(sum(v)/len(v),2) for k,v in sorted(br.items())})
# per block sums
bs=collections.defaultdict(float); sm={}
for x in whole: bs[x['blk']]+=x['res']; sm[x['blk']]=x['sm1']
v=sorted(bs.items(), key=lambda t:t[1])
print("per-block residual sum: min %.1f p10 %.1f med %.1f p90 %.1f max %.1f"%(v[0][1],v[len(v)//10][1],v[len(v)//2][1],v[len(v)*9//10][1],v[-1][1]))
print("slowest blocks (blk,sm,res):", [(k,sm[k],round(r,1)) for k,r in v[-12:]])
print("fastest:", [(k,sm[k],round(r,1)) for k,r in v[:12]])
# is a block consistently slow across rounds? correlation of residual halves
h1=collections.defaultdict(float); h2=collections.defaultdict(float)
for x in whole:
    (h1 if x['r']<tail//2 else h2)[x['blk']]+=x['res']
ks=list(h1); m1=sum(h1[k] for k in ks)/len(ks); m2=sum(h2[k] for k in ks)/len(ks)
cov=sum((h1[k]-m1)*(h2[k]-m2) for k in ks); v1=sum((h1[k]-m1)**2 for k in ks); v2=sum((h2[k]-m2)**2 for k in ks)
print("corr first-half vs second-half block residual: %.2f"%(cov/(v1*v2)**.5))
# biggest single residuals
big=sorted(whole,key=lambda x:-x['res'])[:15]
print("largest tile residuals (blk,sm,r,qt,head,nb,dur,res):")
for x in big: print("  ",x['blk'],x['sm1'],x['r'],x['qt'],x['head'],x['nb'],round(x['dur'],1),round(x['res'],1))
print("---- long tiles (even rounds) by i and same-head count")
cnt=collections.Counter((x['r'],x['head']) for x in whole)
g=collections.defaultdict(list)
for x in whole:
    if x['r']%2==0:
        i=127-x['qt']
        g[(i//8, min(cnt[(x['r'],x['head'])],64)//16)].append(x['res'])
for k in sorted(g): 
    v=g[k]; print(k, len(v), "mean %.1f max %.1f"%(sum(v)/len(v), max(v)))
print("---- short tiles (odd rounds) by i")
g=collections.defaultdict(list)
for x in whole:
    if x['r']%2==1: g[x['qt']//8].append(x['res'])
for k in sorted(g):
    v=g[k]; print(k*8, len(v), "mean %.1f max %.1f"%(sum(v)/len(v), max(v)))
